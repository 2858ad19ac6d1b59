"""Op jobs: the launchpad's doors (submit, retry, cancel) and the runs that rent or release GPUs."""
