"""``irisfed web``: a live dashboard of the federation (read-only, plus an operator's cancel).

The parts, from the edges in:
- ``flags`` / ``settings``: the command line and ``WebSettings`` (every default);
- ``service``: ``WebService``, the process: a uvicorn server, NATS subscriptions
  (``events.*``, ``heartbeat.*``) and the Postgres polling that replaces them while
  NATS is away;
- ``app``: the routes (pages, their live fragments, ``/events``, ``/api/charts``,
  ``/api/users``, login, cancel) and the headers every response carries;
- ``dashboard``: what the routes use of the service (``Dashboard``), so ``app``
  never imports ``service``;
- ``reads``: what each page reads from the store, with the caches shared by every
  viewer, and a job's log tail;
- pure helpers, each unit-tested: ``filters`` (the job list's filters and its
  keyset cursor), ``security`` (sessions, CSRF), ``present`` (what pages show: bars,
  ages, verdicts, a redacted spec, users' usage against their quotas), ``charts`` (series rebuilt from counts and the
  changelog), ``live`` (per-viewer coalescing and server-sent events).

Every value a producer, a peer or a user wrote reaches a page through Jinja's
autoescape (never ``|safe``), and the Content-Security-Policy forbids inline
scripts and styles, so none of it can run or restyle anything.
"""
