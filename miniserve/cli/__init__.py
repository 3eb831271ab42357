"""`python -m miniserve ...` and the `miniserve` command: arguments, generate, chat, bench,
serve, and starting the web app.

torch is imported at its first use, not by the `import torch` lines of the modules these
commands import (core/deferred.py): the web app serves its page before the model, which
needs torch, has loaded."""

from miniserve.core import heap
from miniserve.core.deferred import defer

heap.starting()  # full collections rarer while the modules import (core/heap.py)
defer("torch")
