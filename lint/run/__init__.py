"""``trainlint run``: watch the user's own training run and confirm each hazard with measured numbers.

Nothing here is imported by the static pass: ``trainlint.run.cli`` imports torch only when a run
starts, and the pytest plugin only when ``--trainlint`` is given.
"""
