"""runner/copies.py: the writes that assemble OUT on Ray. A node lost, every shard whose tokens waited in its object
store is marked lost at once, wherever its parts wait: none may go to a Placer made on the lost node, which would
wait for Ray's GCS to find it dead (~14 s)."""

import json
import subprocess
import sys

# A driver joined to the session's Ray (argv: its address) with a SplitFileWrites whose parts wait in each place a
# part can wait, their tokens on node "x" or "y"; prints the shards `lose("x")` returned, and those whose tokens are
# marked lost (ref None).
LOSE = """
import json, sys
from types import SimpleNamespace
import ray
from tokpipe.runner.copies import SplitFileWrites
from tokpipe.runner.task import OnNode

ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
def part(shard, node):
    return SimpleNamespace(buffered=[OnNode(shard, ray.put(shard), node, 0)])
held = [part("done, its turn to come, on x", "x").buffered[0]]
assembler = SimpleNamespace(held=lambda: held)
copies = SplitFileWrites(SimpleNamespace(name="out"), assembler, 4, 2, None, None)
copies.queue.append(part("queued, on x", "x"))
copies.parked += [part("parked for another lost shard, on x", "x"), part("parked, on y", "y")]
everything = [*held, *(p.buffered[0] for p in [*copies.queue, *copies.parked])]
print(json.dumps([sorted(s.shard for s in copies.lose("x")), sorted(s.shard for s in everything if s.ref is None)]))
"""


def test_a_node_lost_marks_lost_every_shard_whose_tokens_waited_there(ray_address):
    found = subprocess.run([sys.executable, "-c", LOSE, ray_address], capture_output=True, text=True)
    assert found.returncode == 0, found.stderr
    on_x = ["done, its turn to come, on x", "parked for another lost shard, on x", "queued, on x"]
    assert json.loads(found.stdout.splitlines()[-1]) == [on_x, on_x]
