"""Think-block markup as the chat templates write it: the reply's reasoning sits between these tokens."""



THINK_OPENER = "<think>"


THINK_CLOSER = "</think>"
