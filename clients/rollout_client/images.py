"""Image helpers for looking at rollouts."""

from collections.abc import Sequence

from PIL import Image, ImageDraw

LABEL_HEIGHT = 14  # pixels of the strip above each labelled row


def _fitted(draw: ImageDraw.ImageDraw, text: str, width: int) -> str:
    """``text``, cut with an ellipsis where it would run past ``width`` pixels."""
    if draw.textlength(text) <= width:
        return text
    while text and draw.textlength(text + "...") > width:
        text = text[:-1]
    return text + "..."


def contact_sheet(
    images: list[Image.Image], columns: int, row_labels: Sequence[str] | None = None
) -> Image.Image:
    """Tile ``images`` row by row, ``columns`` per row, in cells as large as the largest image. With
    ``row_labels`` (one per row, e.g. each row's prompt), a white strip of LABEL_HEIGHT pixels above
    each row carries its label."""
    if not images or columns < 1:
        raise ValueError("a contact sheet needs at least one image and one column")
    cell_width = max(image.width for image in images)
    cell_height = max(image.height for image in images)
    rows = -(-len(images) // columns)
    if row_labels is not None and len(row_labels) != rows:
        raise ValueError(f"{len(row_labels)} row labels for {rows} rows")
    label = LABEL_HEIGHT if row_labels is not None else 0
    sheet = Image.new(
        "RGB", (columns * cell_width, rows * (label + cell_height)), "white" if label else "black"
    )
    draw = ImageDraw.Draw(sheet)
    for k, image in enumerate(images):
        row, column = divmod(k, columns)
        sheet.paste(image.convert("RGB"), (column * cell_width, row * (label + cell_height) + label))
    for row, text in enumerate(row_labels or ()):
        draw.text((2, row * (label + cell_height) + 1), _fitted(draw, text, sheet.width - 4), fill="black")
    return sheet
