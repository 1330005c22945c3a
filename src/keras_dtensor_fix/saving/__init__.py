"""Keras's own saves on many processes: one path shared by every process.

``one_writer`` (each file written once, atomically, by one process per path
and host) and ``handshake`` (a call every process must make fails fast when
only some make it). The ``saving`` family routes Keras's calls here.
"""
