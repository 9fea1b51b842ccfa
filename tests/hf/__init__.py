"""The Hugging Face front door: shard_model on transformers models, and ShardedTrainer."""
