"""What every room stands on: threads that stop together, files that survive a power loss, one writer at a
time, where a path lies (a local folder or an object store), progress and quantities for people."""
