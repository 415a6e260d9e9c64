"""Verifying: the best candidates' stages timed as they will run
(:mod:`~autosplit.verify.stage_timing`, what is timed: :mod:`~autosplit.verify.timed_runs`),
each plan predicted again from them (:mod:`~autosplit.verify.plans`), and the choice among the
candidates on one session, predicted from a second (:mod:`~autosplit.verify.choice`)."""
