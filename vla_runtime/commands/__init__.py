"""The user's commands behind ``vla-runtime`` (``vla_runtime.cli`` dispatches to them) and their
helpers: bench, replay, run, eval, inspect, demo-data, soak, the ALOHA harness.

They sit on top of the runtime (``models``, ``engine``, ``cache``, ``io``, ``ipc``, ``nodes``);
nothing in the runtime imports them (``test/test_import_graph.py``). The project's own training
and demonstration-recording jobs are in ``vla_runtime.training``.
"""
