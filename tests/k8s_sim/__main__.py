import sys

from k8s_sim.server import main

sys.exit(main(sys.argv[1:]))
