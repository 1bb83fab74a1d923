"""The applications built on the stages: init and fork, the round loop (which runs the stages, in this
process on kept engines or as stage processes), demo and its tasks, compare, eval, report, export and
recipes."""
