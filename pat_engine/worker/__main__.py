"""Entry point of a worker process: ``python -m pat_engine.worker <socket fd>``."""

import sys
from multiprocessing.connection import Connection

from pat_engine.worker.worker import worker_main

if __name__ == "__main__":
    worker_main(Connection(int(sys.argv[1])))
