"""splitserve bench: load generator, peers, interference experiment and report (``splitserve bench``)."""
