"""Integrations with the frameworks RL users already run, each imported on its own so
that no framework is needed for another:

- ``gym``: a gymnasium env, used by RLlib's EnvRunners;
- ``verl``: a verl tool (a subclass of verl's ``BaseTool`` when verl is installed);
- ``skyrl``: a SkyRL-gym ``BaseTextEnv``, registered as ``sandman-bash``;
- ``minisweagent``: an environment class for mini-swe-agent.

``pip install 'sandman-ray[integrations]'`` installs the framework versions tested."""
