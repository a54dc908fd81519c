"""Write the README's first two ```bash blocks (install and generate; run the tests) to the two
files given, so that .ci/run runs them exactly as a new user would copy them."""

import re
import sys

readme, *targets = sys.argv[1:]
with open(readme) as f:
    blocks = re.findall(r"^```bash\n(.*?)^```$", f.read(), re.M | re.S)
if len(blocks) < len(targets):
    sys.exit(f"{readme} must start with {len(targets)} ```bash blocks: install, then tests")
for block, target in zip(blocks, targets):
    with open(target, "w") as f:
        f.write(block)
