"""Keras's own saves and loads on many processes (``save``, ``save_weights``,
``load_weights``, ``BackupAndRestore``, one path shared by every process).

``one_writer`` (each file written once, atomically, by one process per path
and host, the others waiting for its outcome) and ``handshake`` (a call every
process must make fails fast when only some make it). The ``saving`` patch
family routes Keras's calls here; sharded checkpoints are ``checkpoint``'s.
"""
