"""The case model: a case's fields and validation, the KV layouts, which tokens each query row
attends, case files."""
