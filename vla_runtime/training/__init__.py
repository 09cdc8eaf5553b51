"""The project's own offline jobs that make the bundled policies: scripted-expert demonstrations
recorded as a robot records them (Meta-World, ALOHA; DAgger rounds), and flow-matching training
of a small pi0.5 of our architecture into a checkpoint the runtime loads unchanged.

Run as modules (``python -m vla_runtime.training.train``, ``...metaworld_demos``,
``...aloha_demos``); the runtime and the user's commands (``vla_runtime.commands``) do not need them.
"""
