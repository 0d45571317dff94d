"""dropless.ep: expert parallelism — dispatch tokens to the devices that hold their experts, combine the results."""
