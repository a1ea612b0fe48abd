"""`treadle run`: a batch of tasks through the rollout service, from the command line.

`cli` parses the command and drives the HTTP client (`treadle.client.http`) against
a running service or one it starts in this process; `progress` is the live display
and the summary table; `report` the HTML report with its per-trajectory timeline.
"""
