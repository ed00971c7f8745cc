"""The frozen target, in one place: loading and feature capture (model), tensor/expert-parallel plans (sharding),
the Ray actor (worker), a target sharded over several actors (group), the service that hands feature batches to
the trainers (feature_service), reply generation for the data stage (generation) and the engine-step profile
(engine_step)."""
