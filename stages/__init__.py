"""The stages of a round, each a resumable job (:class:`gndpo.pipeline.exec.stage.StageJob`): rollout
samples, score adds the teachers' log-probs, normalize computes the round's statistics, train updates
the student. :mod:`gndpo.stages.registry` is how the layers above reach them."""
