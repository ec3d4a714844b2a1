"""Reading results: diagnosis of a disagreement, known kernel bugs, the parameter audit."""
