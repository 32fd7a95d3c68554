"""What the ranks of a job share, and what both the ``Guard`` and the trainer integrations build on.

``ranks`` (who this process is in a launcher, which ranks poll the clouds) -> ``agreement`` (the rank
vote: two small gloo groups, one all-reduce per step) -> ``group`` (an integration's share of it, made
on first use) -> ``window`` (training on in a notice's window, the same on every rank) ->
``stopping`` (what a stop does, in order: flags, outcome, lease, the cloud) -> ``lease`` (the run's
writer lease: global rank 0 holds it, every rank hears whether it got it); ``options`` holds the
options every one of them takes (``CommonOptions``), ``cadence`` where periodic saves land, and
``evaluation`` an evaluation left early on a notice. The ``Guard`` (``spotguard.guard``) and the
integrations (``spotguard.integrations``) import from here; nothing here imports either of them.

The writer lease's record and its holder (``spotguard.checkpoint.lease``, ``.leaseholder``) stay in
``checkpoint/``: the lease is a checkpoint-layout concept built on one storage primitive (a
conditional write), which the CLI uses without any rank. Only what ranks share about it lives here:
which rank holds it, how the others hear the outcome, and the fence that rank hands to its writers.
"""
