"""The GPT-NeoX application: model, weights, data, the fine-tuning run and its tools."""
