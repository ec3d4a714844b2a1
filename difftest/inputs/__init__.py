"""A case's tensors: the data drawn from its seed, and the physical cache and views built
from it."""
