"""xlipkit's toolkit: models, data, objectives, training, evaluation and hub."""
