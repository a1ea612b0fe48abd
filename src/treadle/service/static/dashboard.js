// treadle's dashboard: polls the service's JSON routes with the key it asks for and
// shows what they say. It decides nothing: every number comes from a route
// (docs/dashboard.md). Text from the service is set as text, never as HTML; the
// job's timeline is the service's own page, shown in a sandboxed frame.
'use strict';
(() => {
  const KEY = 'treadle.key';
  const EVERY_MS = Number(new URLSearchParams(location.search).get('every')) || 1000;
  const TIMELINE_EVERY_MS = 5000; // a running job's timeline is redrawn at least this often
  const STATUSES = ['completed', 'truncated', 'max_turns', 'timeout', 'aborted', 'error'];
  const $ = (id) => document.getElementById(id);
  const state = {
    key: sessionStorage.getItem(KEY), job: null, record: null, serviceOpen: true,
    timelineSeen: '', timelineAt: 0, charts: null, timer: null,
  };

  // -- talking to the service ---------------------------------------------------------
  class Refused extends Error {}

  async function api(path, kind = 'json') {
    const r = await fetch(path, { headers: { authorization: `Bearer ${state.key}` },
                                  cache: 'no-store' });
    if (r.status === 401) throw new Refused('the service refused this key');
    if (!r.ok) return { status: r.status, body: null };
    return { status: r.status, body: kind === 'json' ? await r.json() : await r.text() };
  }

  // -- small DOM helpers --------------------------------------------------------------
  function el(tag, text, attrs = {}) {
    const node = document.createElement(tag);
    if (text !== undefined && text !== null) node.textContent = String(text);
    for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
    return node;
  }
  const num = (v, digits = 0) => (v === null || v === undefined ? '–'
    : Number(v).toLocaleString('en-US', { maximumFractionDigits: digits,
                                          minimumFractionDigits: digits }));
  const pct = (v) => `${num(100 * v, 1)}%`;
  function bar(fraction) {
    const outer = el('span', null, { class: 'bar' });
    const inner = el('i');
    inner.style.width = `${Math.max(0, Math.min(1, fraction)) * 100}%`;
    outer.append(inner);
    return outer;
  }
  // A table from a header and rows; a cell is text, a node, or [content, field name].
  // Built apart and put in only when it differs from what is shown: a table rebuilt
  // under the pointer at every refresh would swallow clicks (the press and the
  // release would land on different elements).
  function fill(table, header, rows, onRow) {
    const next = el('table');
    const head = el('tr');
    for (const h of header) head.append(el('th', h));
    next.append(head);
    for (const row of rows) {
      const tr = el('tr');
      for (const cell of row.cells) {
        const [content, field] = Array.isArray(cell) ? cell : [cell, null];
        const td = el('td', content instanceof Node ? null : content);
        if (content instanceof Node) td.append(content);
        if (field) td.dataset.field = field;
        tr.append(td);
      }
      for (const [k, v] of Object.entries(row.data || {})) tr.dataset[k] = v;
      if (onRow) { tr.classList.add('pick'); tr.addEventListener('click', () => onRow(row)); }
      if (row.chosen) tr.classList.add('chosen');
      next.append(tr);
    }
    if (next.innerHTML !== table.innerHTML) table.replaceChildren(...next.childNodes);
  }
  function figures(target, pairs) {
    target.replaceChildren(...pairs.map(([label, value, field]) => {
      const span = el('span', `${label} `);
      span.append(el('b', value, { 'data-field': field }));
      return span;
    }));
  }
  const statusCell = (s, field = 'status') => [el('span', s, { class: `s-${s}` }), field];

  // -- the service: figures and the charts --------------------------------------------
  function showService(status) {
    $('service-note').hidden = state.serviceOpen;
    for (const id of ['service-figures', 'sandboxes']) $(id).hidden = !state.serviceOpen;
    document.querySelector('.charts').hidden = !state.serviceOpen;
    if (!status) return;
    const finished = Object.values(status.finished).reduce((a, b) => a + b, 0);
    figures($('service-figures'), [
      ['running', `${status.running} / ${status.max_live}`, 'running'],
      ['queued', num(status.queued), 'queued'],
      ['finished', num(finished), 'finished'],
      ['tokens sampled', num(status.tokens_generated), 'tokens_generated'],
      ['sessions', num(status.sessions), 'sessions'],
      ['policy version', status.policy_version, 'policy_version'],
      ['weights', status.paused ? 'paused for an update' : 'serving', 'paused'],
    ]);
    fill($('sandboxes'), status.sandboxes.length
      ? ['suite', 'in use', 'idle', 'live / max', 'waiting', 'started']
      : ['none yet: a pool starts with the first trajectory of a suite that runs tools'],
         status.sandboxes.map((p) => ({ data: { suite: p.suite }, cells: [
           p.suite, [num(p.in_use), 'in_use'], num(p.idle), `${p.live} / ${p.max_live}`,
           num(p.waiting), num(p.created)] })));
    drawCharts(status.series);
  }

  function drawCharts(series) {
    const xs = series.map((s) => s.at);
    const col = (name) => series.map((s) => s[name]);
    const data = {
      throughput: [xs, col('tokens_per_s'), col('finished_per_s')],
      tail: [xs, col('running'), col('queued'), col('oldest_running_s')],
    };
    if (!state.charts) {
      const width = Math.max(320, Math.min(640, (document.body.clientWidth - 80) / 2));
      const make = (target, series2, scales, axes) => new uPlot({
        width, height: 200, series: [{}, ...series2], scales, axes,
        legend: { live: false },
      }, [xs, ...series2.map(() => [])], $(target));
      state.charts = {
        throughput: make('chart-throughput', [
          { label: 'tokens/s', stroke: '#3d5a80', width: 2, scale: 'tok' },
          { label: 'trajectories finished/s', stroke: '#2a9d4b', width: 2, scale: 'n' },
        ], { x: { time: true }, tok: {}, n: {} },
        [{}, { scale: 'tok', size: 64 }, { scale: 'n', side: 1, size: 48, grid: { show: false } }]),
        tail: make('chart-tail', [
          { label: 'running', stroke: '#3d5a80', width: 2, scale: 'n' },
          { label: 'queued', stroke: '#e9a23b', width: 2, scale: 'n' },
          { label: 'oldest running (s, service clock)', stroke: '#c51b8a', width: 2,
            scale: 's' },
        ], { x: { time: true }, n: {}, s: {} },
        [{}, { scale: 'n', size: 64 }, { scale: 's', side: 1, size: 48, grid: { show: false } }]),
      };
    }
    state.charts.throughput.setData(data.throughput);
    state.charts.tail.setData(data.tail);
  }

  // -- engines and jobs ---------------------------------------------------------------
  function showEngines(engines) {
    fill($('engines'), ['engine', 'pool', 'health', 'calls / batch', 'queued turns',
                        'engine: running', 'waiting', 'KV use', 'policy version', 'label'],
         engines.map((e) => ({ data: { engine: e.engine_id }, cells: [
           e.engine_id, e.pool, statusCell(e.health, 'health'),
           [`${e.calls_in_flight} / ${e.max_batch}`, 'calls'], [num(e.queued_turns), 'queued_turns'],
           [e.load ? num(e.load.running) : '–', 'load_running'],
           [e.load ? num(e.load.waiting) : '–', 'load_waiting'],
           e.load ? [bar(e.load.kv_usage), 'kv_bar'] : '–',
           [e.policy_version, 'policy_version'], e.label] })));
    // (the KV figure itself, next to its bar)
    for (const e of engines) {
      const cell = $('engines').querySelector(`tr[data-engine="${CSS.escape(e.engine_id)}"] [data-field="kv_bar"]`);
      if (cell && e.load) cell.append(el('span', pct(e.load.kv_usage), { 'data-field': 'kv_usage' }));
    }
  }

  function showJobs(jobs) {
    if (!jobs.some((j) => j.job_id === state.job)) state.job = jobs.length ? jobs[0].job_id : null;
    fill($('jobs'), ['job', 'owner', 'status', 'progress', 'finished', 'running', 'queued',
                     ...STATUSES],
         jobs.map((j) => {
           const progress = el('span');
           progress.append(bar(j.progress), el('span', pct(j.progress)));
           return { data: { job: j.job_id }, chosen: j.job_id === state.job, cells: [
             [j.job_id, 'job_id'], j.owner || 'admin', statusCell(j.status), progress,
             [`${j.delivered} / ${j.planned}`, 'delivered'], [num(j.running), 'running'],
             [num(j.queued), 'queued'],
             ...STATUSES.map((s) => [num(j.counts[s] || 0), `count_${s}`])] };
         }),
         (row) => { state.job = row.data.job; state.record = null; state.timelineSeen = '';
                    refreshSoon(); });
    return jobs.find((j) => j.job_id === state.job) || null;
  }

  async function showJob(job) {
    $('job').hidden = !job;
    if (!job) return;
    $('job-id').textContent = job.job_id;
    figures($('job-figures'), [
      ['status', job.status, 'status'], ['finished', `${job.delivered} of ${job.planned}`, 'delivered'],
      ['running', num(job.running), 'running'], ['queued', num(job.queued), 'queued'],
      ['infrastructure failures', num(job.infrastructure_failures), 'infrastructure_failures'],
    ]);
    const seen = `${job.job_id}/${job.status}/${job.delivered}/${job.running}`;
    const due = job.running > 0 && Date.now() - state.timelineAt > TIMELINE_EVERY_MS;
    if (seen !== state.timelineSeen || due) {
      const page = await api(`/v1/jobs/${encodeURIComponent(job.job_id)}/timeline`, 'text');
      if (page.body !== null) {
        $('timeline').srcdoc = page.body;
        state.timelineSeen = seen;
        state.timelineAt = Date.now();
      }
    }
    const groups = (await api(`/v1/jobs/${encodeURIComponent(job.job_id)}/groups`)).body;
    if (groups) showGroups(groups);
    if (state.record) await showRecord(job.job_id, state.record);
  }

  function showGroups(groups) {
    $('groups-note').textContent = groups.total > groups.groups.length
      ? `(the first ${groups.groups.length} of ${groups.total})` : `(${groups.total})`;
    fill($('groups'), ['group', 'task', 'finished', 'mean reward', 'spread', 'samples (reward or status)'],
         groups.groups.map((g) => {
           const samples = el('span');
           g.trajectory_ids.forEach((tid, i) => {
             const text = g.rewards[i] !== null ? num(g.rewards[i], 2) : g.statuses[i];
             const b = el('button', text, { type: 'button', class: `rep s-${g.statuses[i]}`,
                                            title: tid, 'data-trajectory': tid });
             if (tid === state.record) b.classList.add('chosen');
             b.addEventListener('click', () => { state.record = tid; refreshSoon(); });
             samples.append(b);
           });
           return { data: { group: g.group_id }, cells: [
             g.group_id, g.task_id, [`${g.finished} / ${g.trajectory_ids.length}`, 'finished'],
             [num(g.mean_reward, 3), 'mean_reward'], [num(g.reward_spread, 3), 'reward_spread'],
             samples] };
         }));
  }

  async function showRecord(jobId, trajectoryId) {
    const got = await api(`/v1/jobs/${encodeURIComponent(jobId)}/record?trajectory_id=${
      encodeURIComponent(trajectoryId)}`);
    $('record').hidden = false;
    $('record-id').textContent = trajectoryId;
    const d = got.body;
    if (!d) {
      figures($('record-figures'), [['record', 'not finished yet', 'status']]);
      fill($('turns'), [], []);
      fill($('segments'), [], []);
      return;
    }
    figures($('record-figures'), [
      ['status', d.status, 'status'], ['reward', num(d.reward, 3), 'reward'],
      ['turns', d.turns.length, 'turns'], ['output tokens', num(d.output_tokens), 'output_tokens'],
      ['policy versions', d.policy_versions.join(', '), 'policy_versions'],
      ['llm', `${num(d.llm_s, 2)} s`, 'llm_s'], ['tool', `${num(d.tool_s, 2)} s`, 'tool_s'],
      ['queued', `${num(d.queue_s, 2)} s`, 'queue_s'], ['seq', d.seq, 'seq'],
      ...(d.reason ? [['reason', d.reason, 'reason']] : []),
    ]);
    fill($('turns'), ['turn', 'tokens', 'engine', 'policy version', 'queued s', 'generating s',
                      'tool', 'tool s', 'tool error'],
         d.turns.map((t) => ({ cells: [
           t.index, num(t.output_tokens), t.engine_id || '–', [t.policy_version, 'policy_version'],
           num(t.queued_s, 2), num(t.generating_s, 2), t.tool || '–',
           t.tool_latency_s === null ? '–' : num(t.tool_latency_s, 2), t.tool_error || ''] })));
    fill($('segments'), ['from turn', 'why', 'prompt tokens', 'response tokens', 'sampled',
                         'policy versions'],
         d.segments.map((s) => ({ cells: [
           s.start_turn, s.start_reason, num(s.prompt_tokens), num(s.response_tokens),
           num(s.sampled_tokens), [s.policy_versions.join(', '), 'policy_versions']] })));
    if (!d.segments.length) fill($('segments'), ['no token segments: a replayed trajectory has none'], []);
  }

  // -- the loop -----------------------------------------------------------------------
  async function refresh() {
    clearTimeout(state.timer);
    try {
      const [jobs, engines, status] = await Promise.all([
        api('/v1/jobs?limit=50'), api('/v1/engines'),
        state.serviceOpen ? api('/v1/status') : Promise.resolve({ status: 403, body: null }),
      ]);
      if (status.status === 403) state.serviceOpen = false;
      $('who').textContent = state.serviceOpen ? 'admin: every job'
        : 'trainer key: its own run\'s jobs';
      showService(status.body);
      if (engines.body) showEngines(engines.body);
      const job = jobs.body ? showJobs(jobs.body) : null;
      await showJob(job);
      const marker = $('updated');
      marker.dataset.updates = String(Number(marker.dataset.updates) + 1);
      marker.dataset.state = 'ok';
      marker.textContent = `updated ${new Date().toLocaleTimeString()}`;
    } catch (e) {
      if (e instanceof Refused) { signOut(e.message); return; }
      $('updated').dataset.state = 'error';
      $('updated').textContent = `no answer from the service (${e.message}); retrying`;
    }
    state.timer = setTimeout(refresh, EVERY_MS);
  }
  function refreshSoon() { clearTimeout(state.timer); state.timer = setTimeout(refresh, 0); }

  function signIn(key) {
    state.key = key;
    sessionStorage.setItem(KEY, key);
    $('login').hidden = true;
    $('main').hidden = false;
    $('forget').hidden = false;
    refreshSoon();
  }
  function signOut(why) {
    clearTimeout(state.timer);
    sessionStorage.removeItem(KEY);
    Object.assign(state, { key: null, serviceOpen: true, job: null, record: null });
    $('main').hidden = true;
    $('forget').hidden = true;
    $('login').hidden = false;
    $('login-error').textContent = why || '';
    $('updated').dataset.state = 'idle';
    $('updated').textContent = 'not connected';
  }

  $('login').addEventListener('submit', (ev) => {
    ev.preventDefault();
    const key = $('key').value.trim();
    $('key').value = '';
    if (key) signIn(key);
  });
  $('forget').addEventListener('click', () => signOut(''));
  if (state.key) signIn(state.key); else signOut('');
})();
