"""What score is made of: a unit's rows and the student's forward over them, the teacher backends, the shard."""
