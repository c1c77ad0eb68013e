"""The main job behind `shardtrain train`: config, built-in data and models, the training loop, metrics."""
