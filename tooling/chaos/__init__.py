"""The chaos suite (``irisfed chaos``): seeded random faults against a real federation,
then the invariants.

Each schedule gets a fresh database and subject prefix, a router, a tick and four
peer agents: two run real short processes (``subprocess`` backend, ``sh -c``
jobs in their own sessions, which outlive a SIGKILLed agent), two are
``simulated``. Every service's Postgres connections, and the agents' NATS ones,
go through proxies. Postgres runs durable (fsync and synchronous_commit on), so
a crash that loses an acknowledged submit is a finding, not an artefact.

The producers are the federation's users: ``default`` (v1's subjects, the
``producer`` NATS user) and the configured ``alice`` (a quota of 2 live jobs) and
``bob`` (quotas of 2 cores and 1 gpu), each on its own subjects with its own NATS user
(``user-<id>``). They sometimes reuse another user's job_id, burst past their quotas,
cancel jobs that are not theirs (answered ``not_found``) and send bodies naming a user
(refused).

A seeded schedule mixes submits, cancels and faults: agent kills (also while its
real runs go on), partitions (NATS, Postgres or both), Postgres stalls (a
server that hangs: the proxy holds every byte, nothing is reset) for one
service or all, a rogue agent user publishing forged heartbeats (naming other
peers, huge TTLs) and replaying old ones while their peer's agent is down,
router/tick kills, NATS restarts, and Postgres restarts: clean (fast shutdown)
or crashes (``SIGQUIT`` as ``pg_ctl stop -m immediate``, or SIGKILL of the
postmaster and every backend). After the faults stop and everything is
restored, it waits for every acknowledged job to end and checks docs/design.md §6:
nothing lost, the changelog replays to ``jobs``, epochs never go back, pinned
jobs only on their pin, no double success, never-started cancels never started;
no unpinned job placed on a peer whose agent had been down for over a TTL; no
two live processes of one job under different epochs (see ``RunWatcher``); no
service exiting by itself or logging a dead background task (``task_died``); identity
(§6.9: every job is the job its user sent on its own subject, one job_id from two
users is two jobs, a cancel from another user never touched a job, a stored cancel
names the job's own user or an operator); quotas (§6.10: replaying the changelog
in ``seq`` order, no user's live jobs ever held more than its quota); preemption
(§6.11: only strictly lower bands, never production, on the peer where the preempting
job is placed in the same transaction, never more victims than needed, the victim's
epoch bumped and no write of its old run after it, the victim queued again or ended
with a reason, never lost; see ``checks``); dependencies (§6.16, from the changelog in
``seq`` order: no dependent went live before each dependency ended as its condition
asks; one whose dependency ended breaking it ended ``unschedulable``; none left queued
with every dependency ended; see ``checks``); arrays (§3.8, from the changelog in
``seq`` order: never more of an array's elements live at once than its
``array_parallel``, every array whole, none left with an element held while a slot is
free; see ``checks``); devices (§6.17: no device index of a
node held by two live job processes at once, from their agents' run records; see
``RunWatcher``); and no publish or subscribe refused by
the NATS server to any client (a service whose role lacks a subject it uses).

Bands: most jobs are ``batch``, some ``interactive``, a few ``production`` (alice's
``max_band`` allows it; the others' does not, and now and then they ask it anyway:
``forbidden``). Every schedule has at least one ``squeeze``: one kind of work's peers
filled with batch jobs, then sent that kind of work of a higher band, which preempts.
The summary counts preemptions (by how the victims ended) and the schedules with any.

Pipelines (§3.8): one step of every schedule, and some submit steps, also send one
user's chain of 2-4 jobs, each ``after`` the one before on ``ok``, ``any`` or
``failed`` (its first job failing half the time), so dependents run, and others end
``unschedulable``. The summary counts the chains, their edges, and the dependents
started and ended so.

Arrays (§3.8): one step of every schedule, and some submit steps, also send one user's
array of 3-6 jobs, at most 1-3 live at once, some of its elements failing; some wait
for a job sent just before them, some have a job ``after`` their base id, and some are
cancelled by their base id while they run. The summary counts the arrays, their
elements, and the array that came nearest its limit (most live at once / limit).

``ChaosSettings.restricted_roles`` runs the services on their own Postgres login
roles (``irisfed db-roles``: row-level security) instead of the owner.

Schedule ``i`` of seed ``S`` always draws the same faults, so a failing seed
reproduces: ``irisfed chaos --seed S --schedules 1 --first i`` (what a fault hits,
e.g. which jobs are running, still depends on timing).

Modules: ``world`` (the federation under test: its peers, timings, servers and
services), ``workload`` (the jobs producers submit), ``faults`` (what a step may
break, and how it is mended), ``watcher`` (live job processes, for the
double-run check), ``checks`` (the invariants after convergence), ``schedule``
(one seeded schedule), ``result`` and ``runner`` (many schedules, the summary).
"""

from irisfed.tooling.chaos.result import ChaosSummary, ScheduleResult
from irisfed.tooling.chaos.runner import ChaosSettings, run_chaos

__all__ = ["ChaosSettings", "ChaosSummary", "ScheduleResult", "run_chaos"]
