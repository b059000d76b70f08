"""One column of a locally saved Hugging Face `datasets` table, read batch by batch: Parquet
files, and Arrow IPC files as `Dataset.save_to_disk` writes them (the stream format; the file
format too). pyarrow is optional (`pip install 'meshtrain[datasets]'`), so it is imported only
when a table is read.

Nothing here holds a whole table: Parquet is read in record batches of the one column, Arrow
files are memory-mapped (the batches are views of the pages, which the system can drop), and
values reach Python `ROWS_PER_CHUNK` rows at a time.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from pathlib import Path

from meshtrain.errors import Code, SettingError

TABLE_SUFFIXES = (".parquet", ".arrow")
ROWS_PER_CHUNK = 128  # rows made Python objects at once: long documents keep this small
_ARROW_FILE_MAGIC = b"ARROW1"  # the IPC file format; the stream format has no magic


class UnreadableTable(Exception):
    """A table pyarrow cannot open or read (its first line of explanation)."""


def require_pyarrow(files: Iterable[Path]) -> None:
    """Refuse table inputs before any work when pyarrow is missing, with the fix."""
    table = next((path for path in files if path.suffix in TABLE_SUFFIXES), None)
    if table is not None:
        try:
            import pyarrow  # noqa: F401
        except ImportError:
            raise SettingError(Code.PYARROW_PACKAGE,
                               f"{table}: .parquet and .arrow files need the pyarrow library:"
                               " pip install 'meshtrain[datasets]' (from a clone: pip install -e"
                               " '.[datasets]')") from None


class Table:
    """A Parquet or Arrow file open for reading: its size, row count, column names and one
    column."""

    def __init__(self, path: Path):
        import pyarrow as pa

        with _unreadable():
            self.size = path.stat().st_size
            if path.suffix == ".parquet":
                import pyarrow.parquet as pq

                self._parquet = self._source = pq.ParquetFile(path)
                self.rows = self._parquet.metadata.num_rows
                self.columns = self._parquet.schema_arrow.names
            else:
                self._parquet, self._source = None, pa.memory_map(str(path))
                schema, batches = self._arrow_batches()
                self.rows, self.columns = sum(batch.num_rows for batch in batches), schema.names

    def __enter__(self) -> Table:
        return self

    def __exit__(self, *exc) -> None:
        self._source.close()

    def row_bytes(self, row: int) -> int:
        """The file's bytes shared out evenly by row: what a row stands for in progress."""
        return self.size * (row + 1) // self.rows - self.size * row // self.rows

    def values(self, column: str) -> Iterator[list]:
        """The column's values in row order, a chunk of rows at a time (see `_python`)."""
        with _unreadable():
            if self._parquet is not None:
                batches = self._parquet.iter_batches(batch_size=ROWS_PER_CHUNK, columns=[column])
            else:
                batches = self._arrow_batches()[1]
            for batch in batches:
                array = batch.column(column)
                for start in range(0, len(array), ROWS_PER_CHUNK):
                    yield _python(array.slice(start, ROWS_PER_CHUNK))

    def _arrow_batches(self):
        """(schema, record batches) of the IPC file or stream, from its start."""
        import pyarrow.ipc as ipc

        self._source.seek(0)
        if self._source.read(len(_ARROW_FILE_MAGIC)) == _ARROW_FILE_MAGIC:
            reader = ipc.open_file(self._source)
            return reader.schema, (reader.get_batch(i) for i in range(reader.num_record_batches))
        self._source.seek(0)
        reader = ipc.open_stream(self._source)
        return reader.schema, reader


def row_count(path: Path) -> int:
    with Table(path) as table:
        return table.rows


@contextlib.contextmanager
def _unreadable():
    import pyarrow as pa

    try:
        yield
    except (OSError, pa.ArrowException) as err:
        raise UnreadableTable(str(err).splitlines()[0] if str(err) else type(err).__name__) \
            from err


def _python(array) -> list:
    """Arrow values as Python ones; a string that is not UTF-8 (Arrow files do not check) comes
    as its UnicodeDecodeError, for the reader to report with its row."""
    try:
        return array.to_pylist()
    except UnicodeDecodeError:
        return [_scalar(value) for value in array]


def _scalar(value):
    try:
        return value.as_py()
    except UnicodeDecodeError as err:
        return err
