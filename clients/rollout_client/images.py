"""Image helpers for looking at rollouts."""

from PIL import Image


def contact_sheet(images: list[Image.Image], columns: int) -> Image.Image:
    """Tile ``images`` row by row, ``columns`` per row, in cells as large as the largest image."""
    if not images or columns < 1:
        raise ValueError("a contact sheet needs at least one image and one column")
    cell_width = max(image.width for image in images)
    cell_height = max(image.height for image in images)
    rows = -(-len(images) // columns)
    sheet = Image.new("RGB", (columns * cell_width, rows * cell_height))
    for k, image in enumerate(images):
        row, column = divmod(k, columns)
        sheet.paste(image.convert("RGB"), (column * cell_width, row * cell_height))
    return sheet
