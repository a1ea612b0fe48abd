"""The SQLite schema and its migrations, versioned by ``PRAGMA user_version``.

``MIGRATIONS[v]`` takes a database from version ``v`` to ``v + 1``; a new file is
version 0 and gets every step. Each step runs in its own ``BEGIN IMMEDIATE``
transaction together with the version bump, and re-reads the version inside it, so
two processes opening the same new file cannot both apply a step. Migrations are
append-only: a released step is never edited, a change is a new step.
"""

from __future__ import annotations

import sqlite3

from treadle.store.errors import SchemaError

MIGRATIONS: tuple[tuple[str, ...], ...] = (
    # 1: jobs, their planned trajectories (one row each, the result once finished),
    # and diagnostic events.
    (
        """CREATE TABLE jobs (
            job_id       TEXT PRIMARY KEY,
            spec         TEXT NOT NULL,            -- the request, as JSON
            status       TEXT NOT NULL,            -- JobStatus value
            reason       TEXT,                     -- why it was cancelled or failed
            created_at   REAL NOT NULL,
            started_at   REAL,                     -- first trajectory started or finished
            finished_at  REAL,                     -- status became terminal
            planned      INTEGER NOT NULL,         -- trajectories in the plan
            delivered    INTEGER NOT NULL DEFAULT 0  -- results so far = last seq given
        )""",
        "CREATE INDEX jobs_by_status ON jobs (status, created_at)",
        """CREATE TABLE trajectories (
            job_id        TEXT NOT NULL REFERENCES jobs (job_id) ON DELETE CASCADE,
            trajectory_id TEXT NOT NULL,
            pos           INTEGER NOT NULL,        -- position in the plan
            group_id      TEXT NOT NULL,
            task_id       TEXT NOT NULL,
            repetition    INTEGER NOT NULL,
            status        TEXT NOT NULL,           -- TrajectoryStatus value
            attempts      INTEGER NOT NULL DEFAULT 0,  -- times started
            seq           INTEGER,                 -- delivery number; NULL until finished
            record        TEXT,                    -- the trajectory record; NULL until finished
            reason        TEXT,
            started_at    REAL,
            finished_at   REAL,
            PRIMARY KEY (job_id, trajectory_id),
            UNIQUE (job_id, seq)
        )""",
        "CREATE INDEX trajectories_by_status ON trajectories (job_id, status)",
        "CREATE INDEX trajectories_by_pos ON trajectories (job_id, pos)",
        """CREATE TABLE events (
            event_id      INTEGER PRIMARY KEY AUTOINCREMENT,
            job_id        TEXT NOT NULL REFERENCES jobs (job_id) ON DELETE CASCADE,
            trajectory_id TEXT,
            kind          TEXT NOT NULL,
            payload       TEXT NOT NULL,           -- JSON
            at            REAL NOT NULL
        )""",
        "CREATE INDEX events_by_job ON events (job_id, event_id)",
    ),
    # 2: the request out of the job row, and the job's trajectories per status on it.
    # Every finish updates its job's row (the delivered counter); SQLite rewrites a
    # row whole, overflow pages included, so a spec in it made each finish cost the
    # size of the request. Counting statuses with a GROUP BY made each job() read
    # cost the size of the job; the counts, updated with the row, cost nothing more.
    (
        """CREATE TABLE job_specs (
            job_id  TEXT PRIMARY KEY REFERENCES jobs (job_id) ON DELETE CASCADE,
            spec    TEXT NOT NULL                  -- the request, as JSON
        )""",
        "INSERT INTO job_specs (job_id, spec) SELECT job_id, spec FROM jobs",
        # Emptied, not dropped: ALTER TABLE DROP COLUMN needs SQLite 3.35, and the
        # Pythons of long-lived distributions (RHEL 8: 3.26) link older ones. An
        # empty string keeps the row small; nothing reads the column any more.
        "UPDATE jobs SET spec = ''",
        # n_<status>: the job's trajectories in that TrajectoryStatus.
        "ALTER TABLE jobs ADD COLUMN n_pending INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE jobs ADD COLUMN n_running INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE jobs ADD COLUMN n_completed INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE jobs ADD COLUMN n_truncated INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE jobs ADD COLUMN n_max_turns INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE jobs ADD COLUMN n_timeout INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE jobs ADD COLUMN n_aborted INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE jobs ADD COLUMN n_error INTEGER NOT NULL DEFAULT 0",
        "UPDATE jobs SET "
        "n_pending = (SELECT count(*) FROM trajectories t "
        "WHERE t.job_id = jobs.job_id AND t.status = 'pending'), "
        "n_running = (SELECT count(*) FROM trajectories t "
        "WHERE t.job_id = jobs.job_id AND t.status = 'running'), "
        "n_completed = (SELECT count(*) FROM trajectories t "
        "WHERE t.job_id = jobs.job_id AND t.status = 'completed'), "
        "n_truncated = (SELECT count(*) FROM trajectories t "
        "WHERE t.job_id = jobs.job_id AND t.status = 'truncated'), "
        "n_max_turns = (SELECT count(*) FROM trajectories t "
        "WHERE t.job_id = jobs.job_id AND t.status = 'max_turns'), "
        "n_timeout = (SELECT count(*) FROM trajectories t "
        "WHERE t.job_id = jobs.job_id AND t.status = 'timeout'), "
        "n_aborted = (SELECT count(*) FROM trajectories t "
        "WHERE t.job_id = jobs.job_id AND t.status = 'aborted'), "
        "n_error = (SELECT count(*) FROM trajectories t "
        "WHERE t.job_id = jobs.job_id AND t.status = 'error')",
    ),
    # 3: who may see a job, and the trainer keys made through the API. A job's owner
    # is the trainer run whose key submitted it (NULL: the admin's, as every job
    # before this version). A key is kept only as its SHA-256: the store never holds
    # one a reader of the file could use.
    (
        "ALTER TABLE jobs ADD COLUMN owner TEXT",
        """CREATE TABLE trainer_keys (
            key_id       TEXT PRIMARY KEY,         -- its public name (lists, revocation)
            digest       TEXT NOT NULL UNIQUE,     -- SHA-256 of the key, hex
            trainer_run  TEXT NOT NULL,            -- the run it speaks for
            created_at   REAL NOT NULL
        )""",
    ),
    # 4: continuous jobs. Their plan grows a GRPO group at a time (`open`: the plan may
    # still grow, so the job is not completed when every trajectory so far is); the
    # trainer takes whole groups, each once (`job_groups.taken`, dense per job; the take
    # call that got it, `take_id`, gets the same groups if it asks again), and a
    # member restarted as stale is superseded by a new trajectory of its group.
    (
        "ALTER TABLE jobs ADD COLUMN open INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE jobs ADD COLUMN taken INTEGER NOT NULL DEFAULT 0",  # groups handed out
        "ALTER TABLE trajectories ADD COLUMN superseded INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE trajectories ADD COLUMN first_version INTEGER",  # oldest sampled
        """CREATE TABLE job_groups (
            job_id      TEXT NOT NULL REFERENCES jobs (job_id) ON DELETE CASCADE,
            group_id    TEXT NOT NULL,
            pos         INTEGER NOT NULL,          -- launch order in the job's task stream
            size        INTEGER NOT NULL,          -- members
            done        INTEGER NOT NULL DEFAULT 0,  -- current members finished
            ready_seq   INTEGER,                   -- order it became whole; NULL while not
            taken       INTEGER,                   -- take number; NULL until handed out
            take_id     TEXT,                      -- the take call that handed it out
            stale       INTEGER NOT NULL DEFAULT 0,  -- handed out flagged stale
            PRIMARY KEY (job_id, group_id),
            UNIQUE (job_id, taken)
        )""",
        "CREATE INDEX job_groups_ready ON job_groups (job_id, taken, ready_seq)",
        "CREATE INDEX job_groups_by_take ON job_groups (job_id, take_id)",
    ),
    # 5: the turn journal (`treadle.store.journal`): unfinished trajectories' completed
    # turns and their resumes, so a restart resumes each from its last turn.
    (
        """CREATE TABLE journal (
            job_id        TEXT NOT NULL REFERENCES jobs (job_id) ON DELETE CASCADE,
            trajectory_id TEXT NOT NULL,
            kind          TEXT NOT NULL,           -- "turn" | "resume"
            n             INTEGER NOT NULL,        -- turn index | attempt index
            tokens        INTEGER NOT NULL,        -- tokens the turn sampled
            body          BLOB NOT NULL,           -- MessagePack (treadle.agent.journal)
            PRIMARY KEY (job_id, trajectory_id, kind, n)
        ) WITHOUT ROWID""",
    ),
)

SCHEMA_VERSION = len(MIGRATIONS)


def user_version(conn: sqlite3.Connection) -> int:
    return int(conn.execute("PRAGMA user_version").fetchone()[0])


def migrate(conn: sqlite3.Connection) -> int:
    """Bring the database to SCHEMA_VERSION; returns the version it had before.

    `conn` must be in autocommit mode (isolation_level None). Raises SchemaError for
    a file from a newer treadle, a version-0 file that already holds other tables.
    """
    before = user_version(conn)
    while True:
        conn.execute("BEGIN IMMEDIATE")
        try:
            version = user_version(conn)
            if version > SCHEMA_VERSION:
                raise SchemaError(f"the store's schema version is {version}, newer than this "
                                  f"treadle's {SCHEMA_VERSION}; upgrade treadle to open it")
            if version == SCHEMA_VERSION:
                conn.execute("COMMIT")
                return before
            if version == 0:
                tables = {row[0] for row in conn.execute(
                    "SELECT name FROM sqlite_master WHERE type = 'table' "
                    "AND name NOT LIKE 'sqlite_%'")}
                if tables:
                    raise SchemaError(f"not a treadle store: it holds tables "
                                      f"{', '.join(sorted(tables))} but no schema version")
            for statement in MIGRATIONS[version]:
                conn.execute(statement)
            # PRAGMA takes no parameters; the value is an int we computed.
            conn.execute(f"PRAGMA user_version = {version + 1}")
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise

