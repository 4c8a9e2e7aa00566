"""Print the README's quick-start commands, one per line, exactly as written (the lines of
its ```bash block, comments dropped): .ci/run runs them as a newcomer would."""
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

with open(os.path.join(ROOT, 'README.md')) as f:
    text = f.read()
section = re.search(r'^## Quick start\n(.*?)(?=^## )', text, re.M | re.S)
block = re.search(r'^```bash\n(.*?)^```', section.group(1) if section else '', re.M | re.S)
commands = [line for line in (block.group(1) if block else '').splitlines() if line.strip() and not
            line.lstrip().startswith('#')]
if len(commands) != 2:
    sys.exit("README.md's quick start must hold exactly two commands in a ```bash block (found %d)" % len(commands))
print('\n'.join(commands))
