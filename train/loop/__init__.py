"""The training loop: building the components, one optimizer step, and the loop that drives them."""
