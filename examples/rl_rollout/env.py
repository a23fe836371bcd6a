"""``CodeRepairEnv``: the code-repair task as a gymnasium environment on sandboxes.

One task per episode. ``reset`` leases a sandbox, puts a fresh buggy repository in it,
reads the module and runs the tests; the observation is ``coderepair.features`` of
what it saw. ``step(edit)`` applies that edit, runs the tests again, and ends the
episode with reward 1 when they pass.
"""

from typing import Optional

import numpy as np
from gymnasium import spaces

from coderepair import EDITS, FEATURES, REPO_DIR, TEST_COMMAND, edit_mask, features, make_task
from sandman_ray.integrations.gym import SandboxEnv
from sandman_ray.spec import DEFAULT_IMAGE


class CodeRepairEnv(SandboxEnv):
    """config (RLlib's ``env_config``): ``pool`` (default ``default``), ``image``
    (needs python3; default ``host``)."""

    observation_space = spaces.Box(0.0, 1.0, (len(FEATURES),), np.float32)
    action_space = spaces.Discrete(len(EDITS))

    def __init__(self, config: Optional[dict] = None):
        config = dict(config or {})
        super().__init__(config.get("image", DEFAULT_IMAGE), pool=config.get("pool", "default"))
        self.task = None
        self.source = ""

    def setup(self, options):
        self.task = make_task(int(self.np_random.integers(2 ** 31)))
        self.put_files(self.task.files, REPO_DIR)
        self.source = self.exec("cat " + self.task.module_path, cwd=REPO_DIR).text
        tests = self.exec(TEST_COMMAND, cwd=REPO_DIR)
        if tests.exit_code == 0:
            raise RuntimeError("task %s passes before any edit" % self.task.task_id)
        self.observation = np.asarray(features(self.source, tests.text), dtype=np.float32)
        return self.observation, {"family": self.task.family,
                                  "offered": edit_mask(self.source)}

    def act(self, action):
        edit = EDITS[int(action)]
        if edit.applies(self.source):  # an edit that matches nothing leaves the file as is
            self.put_files({self.task.module_path: edit.apply(self.source)}, REPO_DIR)
        tests = self.exec(TEST_COMMAND, cwd=REPO_DIR)
        reward = 1.0 if tests.exit_code == 0 else 0.0
        return self.observation, reward, True, False, {"family": self.task.family}
