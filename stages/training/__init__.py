"""What train is made of: batches, the DeepSpeed engine, checkpoints, the EMA teacher."""
