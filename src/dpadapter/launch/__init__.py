"""How a job's process starts (layer 6, entry points): the command line, the fork server, the
parent that watches.

`cli` parses `python -m dpadapter ...` (the `dpadapter` script) and dispatches to a stage;
`prefork` is the local run's fork server that hands a job to a child with torch already
imported; `supervise` is the light parent that waits on a job run without that server and
reports a kill for memory. Entry points may import every layer; nothing below imports them
(only `dpadapter.__main__` and the rule files do).
"""
