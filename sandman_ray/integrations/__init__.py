"""Integrations with trainers: ``gym`` (a gymnasium env, used by RLlib's EnvRunners) and
``verl`` (a tool with verl's create/execute/calc_reward/release lifecycle). Each is
imported on its own, so neither framework is needed for the other."""
