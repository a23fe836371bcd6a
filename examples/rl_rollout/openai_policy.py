"""``--policy openai``: ask any OpenAI-compatible chat endpoint which edit to apply.

The observation sent is what the agent saw in its sandbox (the module and the test
output) and the numbered edits it may apply; the reply's first offered number is the
choice. Standard library only (urllib), run on a thread so episodes keep going.
"""

import asyncio
import json
import os
import re
import urllib.request
from typing import Sequence

from coderepair import EDITS

PROMPT = """You are fixing a bug in a small Python repository.

The module:
```python
{source}
```

Its tests printed:
```
{tests}
```

Apply exactly one of these edits (each rewrites the first place its pattern matches):
{edits}

Answer with the number of the edit only."""


class OpenAIChooser:
    """Chooses an edit by asking ``model`` at ``base_url`` (e.g. ``http://host:8000/v1``);
    the key is read from the environment variable ``api_key_env`` when it is set."""

    def __init__(self, base_url: str, model: str, api_key_env: str = "OPENAI_API_KEY",
                 timeout_s: float = 60.0):
        if not base_url.startswith(("http://", "https://")):
            raise ValueError("--openai-base-url must be an http(s) URL, got %r" % base_url)
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model, self.timeout_s = model, timeout_s
        self.api_key = os.environ.get(api_key_env, "")

    async def choose(self, source: str, test_output: str, offered: Sequence[bool]) -> int:
        edits = "\n".join("%d: %s" % (i, e.name) for i, e in enumerate(EDITS) if offered[i])
        prompt = PROMPT.format(source=source, tests=test_output.strip(), edits=edits)
        reply = await asyncio.get_running_loop().run_in_executor(None, self._ask, prompt)
        for number in re.findall(r"\d+", reply):
            if int(number) < len(EDITS) and offered[int(number)]:
                return int(number)
        raise ValueError("the model's answer names no offered edit: %r" % reply[:200])

    def _ask(self, prompt: str) -> str:
        body = json.dumps({"model": self.model, "temperature": 0.7,
                           "messages": [{"role": "user", "content": prompt}]}).encode()
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = "Bearer " + self.api_key
        request = urllib.request.Request(self.url, data=body, headers=headers)
        with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
            answer = json.load(response)
        return answer["choices"][0]["message"]["content"]
