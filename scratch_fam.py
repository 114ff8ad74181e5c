import sys
from tests.harness import run_distributed, unwrap_results
from tests.multimodal_harness import Case, run_matrix

if __name__ == "__main__":
    fams = sys.argv[1].split(",")
    world = int(sys.argv[2])
    cases = [Case(f, "mixed") for f in fams] + [Case(f, "padded", ring=2) for f in fams]
    res = unwrap_results(run_distributed(world, run_matrix, cases, world))[0]
    for k, v in res.items():
        print(world, k, v, flush=True)
