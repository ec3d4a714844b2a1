"""What a run records: result records, failure directories, case features, the lines of kernel
trees a run executed."""
