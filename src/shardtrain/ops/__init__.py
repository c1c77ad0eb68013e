"""Operations on a sharded model around the training step."""
