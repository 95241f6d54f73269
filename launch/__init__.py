"""The entry points: the `cohort` command, the local process stack and `cohort serve`.

This package sits above every other one (it starts them) and nothing imports it: the tools that
spawn whole stacks (the e2e tests, the live benchmark) use `procstack`, which names
`launch.cli` as the command of each process it starts.

No model or data set is downloaded at run time: the hub's offline switch is set here, before any
module imports huggingface_hub (which reads it once, at import).
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
