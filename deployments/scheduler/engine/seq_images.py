"""A request's images in the engine: their checks at admission, and each step's share of them.

A step covering placeholder rows of an image carries it as a `StepImage`: its place and grids, and its
patches the first time (the rank keeps the embeddings until the image's last placeholder row is computed;
`Sequence.images_on_rank` says which it holds). Every step of a sequence with images also carries the
position shift of the images wholly before its first row, so text after an image, decode rounds and
drafts all continue from the image's positions (docs/engine.md, Vision).
"""

from deployments.messages.images import ImageInput
from deployments.messages.replies import Refusal
from deployments.messages.requests import EngineRequest
from deployments.messages.step import SeqStep, StepImage
from deployments.scheduler.engine.sequence import Sequence


def image_refusal(request: EngineRequest, image_token_id: int | None, merge: int) -> Refusal | None:
    """Why the engine cannot run the request's images (None: it can, or there are none): no vision tower,
    or placeholders that do not match their images, so no placeholder ever runs without its pixels."""
    if image_token_id is None:
        if request.images:
            return Refusal("this server does not read images (it runs without --vision)", request.prompt_param)
        return None
    prompt, end = request.prompt_token_ids, 0
    for index, image in enumerate(request.images):
        problem = _image_problem(image, prompt, end, image_token_id, merge)
        if problem is not None:
            return Refusal(f"image {index}: {problem}", request.prompt_param)
        end = image.end
    if prompt.count(image_token_id) != sum(image.length for image in request.images):
        return Refusal("the prompt has image placeholders without an image", request.prompt_param)
    return None


def _image_problem(image: ImageInput, prompt: list[int], after: int, token: int, merge: int) -> str | None:
    t, h, w = image.grid_thw
    if min(t, h, w) < 1 or h % merge or w % merge:
        return f"its patch grid {list(image.grid_thw)} does not merge by {merge}"
    if image.length != t * h * w // merge**2 or image.pixel_values.shape[0] != t * h * w:
        return "its placeholder count or patches do not match its patch grid"
    if image.offset < after or image.end > len(prompt):
        return "its placeholders overlap another image or run past the prompt"
    if any(prompt[i] != token for i in range(image.offset, image.end)):
        return "its span holds tokens other than the image placeholder"
    return None


def token_grid(image: ImageInput, merge: int) -> tuple[int, int, int]:
    t, h, w = image.grid_thw
    return t, h // merge, w // merge


def plan_images(seq: Sequence, step: SeqStep, count: int, merge: int) -> None:
    """Set the step's position shift and its images, for its first `count` rows (drafts are text)."""
    start, end = step.num_computed, step.num_computed + count
    for index, image in enumerate(seq.request.images):
        placed = StepImage(f"{seq.request_id}/{index}", image.offset, token_grid(image, merge), image.grid_thw)
        if image.end <= start:
            step.rope_delta += placed.position_shift
        elif image.offset < end:
            if index not in seq.images_on_rank:
                placed.pixel_values = image.pixel_values
            step.images.append(placed)
            if image.end <= end:
                seq.images_on_rank.discard(index)  # the rank drops it after this step
            else:
                seq.images_on_rank.add(index)


def release_images(seq: Sequence) -> list[str]:
    """The keys of the embeddings the rank holds for a sequence that ends or is preempted mid-image."""
    keys = [f"{seq.request_id}/{index}" for index in sorted(seq.images_on_rank)]
    seq.images_on_rank.clear()
    return keys
