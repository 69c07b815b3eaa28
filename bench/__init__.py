"""The benchmark harness of splitserve; not tests. Entry points: ``python -m bench.<name>``
(``throughput``, ``disagg``, ``spec_decode``, ``kv_transfer``, ``default_model``, ``chaos``,
``fuzz``) and ``splitserve bench``
(``bench.main``). One module per job; see ``bench/README.md``.

Kept light: importing ``bench`` imports neither torch nor the engine.
"""
