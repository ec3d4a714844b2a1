"""Project conftest: the difftest plugin itself is loaded through its pytest11 entry point."""
