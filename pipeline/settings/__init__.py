"""The settings a run is made of, declared (:mod:`.schema`): the lowest floor of the foundation, so
every part of it can name the settings it takes; reading and checking them is :mod:`gndpo.pipeline.config`'s."""
