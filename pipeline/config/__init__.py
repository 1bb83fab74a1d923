"""Reading and checking a config: a YAML file and ``key=value`` overrides (:mod:`.load`), each value
against its declaration (:mod:`.validate`), settings against each other (:mod:`.checks`), and the keys
as the reference lists them (:mod:`.keys`). What the settings are is :mod:`gndpo.pipeline.settings`'s."""
