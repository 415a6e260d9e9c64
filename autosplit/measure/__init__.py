"""Measuring: each block timed at several micro-batch sizes, its memory and the bytes crossing
each cut (:mod:`~autosplit.measure.profiler`), and the machine's own figures — the link, the
replicas' all-reduce, torch's pipeline runtime per action — measured once per machine and kept
in a cache (:mod:`~autosplit.measure.machine_cache`).

The profiler times blocks round after round (:mod:`~autosplit.measure.block_timing`) in a fresh
timing process (:mod:`~autosplit.measure.timing_process`), beside a neighbouring worker where
workers share a CPU (:mod:`~autosplit.measure.contention`), setting aside rounds the hypervisor
took (:mod:`~autosplit.measure.steal_time`); spreads are half the interquartile range
(:mod:`~autosplit.measure.spread`). Nothing here plans, verifies or runs a plan.
"""
