"""Built on the stages: init, fork, the demo, compare and evaluation."""
