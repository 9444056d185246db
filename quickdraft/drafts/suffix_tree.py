"""The suffix tree behind the `suffix` draft (drafts/suffix.py; SuffixDecoding, Oliaro et al. 2024, as in
Snowflake's Arctic Inference): an index of the running requests' text (prompt and output) and a bounded cache of
earlier requests' text.

The index (`SuffixIndex`) is one generalized suffix tree over many texts ("docs"), depth-bounded and
path-compressed (Arctic Inference's design): every suffix of every doc, cut at `max_depth` tokens, is a path
from the root; a node's `count` is the number of those suffixes that pass through or end at it, so for a node
reached by a string s, a child's count / the sum of the children's counts is the empirical probability of
the child's first token after s. An edge's tokens are not stored: a node refers to one occurrence of its
edge in some doc (`doc`, `start`), and a doc's tokens are only ever appended to.

Each running request is one doc. Appending a token extends the doc's active suffixes (the last max_depth of
them, `doc.active`, longest first) by one: a suffix that occurs nowhere else sits alone in a leaf whose edge
runs to the doc's end, and grows with it at no cost ("open" leaves); the others are moved one token down the
tree (a few dictionary operations each). So appending costs O(length of the longest repeated suffix) and
never more than O(max_depth); for the doc being decoded, the node where its last m tokens end is simply
`doc.active[-m]`, for every m at once, and proposing needs no search.

A draft follows the longest match: the longest suffix of the request's text that occurs earlier (in its own
text or any cached doc) with a continuation. From there it takes, token by token, the most frequent
continuation (the child with the highest count; ties mostly go to the most recent), multiplying the
empirical probabilities count / (sum of the siblings' counts + a pseudo-count for continuations not seen
yet: 10 at a context of one token, halving with each further token), and stops when that product falls
below `min_token_prob`, at `max_spec_factor` x the match length, at `max_spec_tokens`, or where every
occurrence ends. Past the tree's depth it re-anchors on the last max_depth // 2 tokens. No confident match:
no draft (a token seen once after a single matching token is not confident: 1 / 11). A token tree
(`speculate_tree`) takes every continuation from the same match instead, the most probable paths first, each
while its product stays above min_token_prob.

The cache: a finished doc (`finish`: its request ended, Proposer.release) stays in the tree as cached text
until the whole index holds more than `max_cached_tokens` tokens; then finished docs are removed least
recently used first (a doc is used when a draft follows its text). Running requests' docs are never evicted.
Removing a doc walks its suffixes, decrements their counts, deletes what falls to zero and re-points nodes
that referred to it (O(its length x depth)).
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict, deque

from quickdraft.errors import QuickdraftError

DEFAULT_MAX_DEPTH = 24
DEFAULT_MAX_CACHED_TOKENS = 1 << 18  # about 70 MB of index when full (~0.28 KB a token)
DEFAULT_MAX_SPEC_FACTOR = 1.0
DEFAULT_MIN_TOKEN_PROB = 0.1
# A pseudo-count of continuations not seen yet, at a context of one token, halving with each further token:
# a continuation seen once after a single matched token is not a confident draft (it is right about one time
# in seven on Spec-Bench's prompts), one seen after four or more matched tokens mostly is.
DEFAULT_UNSEEN_PRIOR = 10.0


def check_index_settings(max_depth: int, max_tokens: int) -> None:
    """The index's two settings (speculative_config's suffix_decoding_max_tree_depth and
    suffix_decoding_max_cached_tokens), refused with what to give instead."""
    if not (isinstance(max_depth, int) and max_depth >= 2):
        raise QuickdraftError(f"suffix: max tree depth (suffix_decoding_max_tree_depth) must be an integer >= 2, "
                              f"got {max_depth!r}")
    if not (isinstance(max_tokens, int) and max_tokens >= 0):
        raise QuickdraftError(f"suffix: max cached tokens (suffix_decoding_max_cached_tokens) must be an integer "
                              f">= 0 (0: keep no finished text), got {max_tokens!r}")


class _Node:
    """A node of the suffix tree: the edge from its parent is doc.tokens[start:start + length] (for an open leaf
    the length runs to min(len(doc.tokens), limit)).

    count: suffixes passing through or ending here. cont: the sum of the children's counts (the suffixes
    that continue past this node). best: the child with the highest count, or None when unknown. ends:
    {doc: end index} for docs with a suffix ending here (one such end per doc), None when empty; an open leaf's
    one end is implicit (its doc's end). limit: for an open leaf, the end index its edge stops at (its
    suffix's start + max_depth); None for a closed node, whose length is `length`."""

    __slots__ = ("count", "cont", "parent", "children", "best", "doc", "start", "length", "limit", "ends")

    def __init__(self, parent, doc, start: int, length: int, limit, count: int):
        self.count = count
        self.cont = 0
        self.parent = parent
        self.children: dict[int, _Node] | None = None
        self.best: _Node | None = None
        self.doc = doc
        self.start = start
        self.length = length
        self.limit = limit
        self.ends: dict[_Doc, int] | None = None

    def edge_length(self) -> int:
        if self.limit is None:
            return self.length
        return min(len(self.doc.tokens), self.limit) - self.start


class _Doc:
    """One text in the index: its tokens, its active suffixes' nodes (None once finished), and an id."""

    __slots__ = ("tokens", "active", "serial")

    def __init__(self, max_depth: int, serial: int):
        self.tokens: list[int] = []
        self.active: deque[_Node] | None = deque(maxlen=max_depth)
        self.serial = serial

    @property
    def finished(self) -> bool:
        return self.active is None

    def __repr__(self) -> str:
        return f"<doc {self.serial}: {len(self.tokens)} tokens{' finished' if self.finished else ''}>"


class SuffixIndex:
    """A depth-bounded generalized suffix tree over docs, with a token budget for finished docs (see the module
    docstring). Docs are appended to while they run (`extend`), then `finish`ed into the cache, where the
    least recently used are removed once the index holds more than `max_tokens` tokens (0: a finished doc is
    removed at once, so only running docs are indexed)."""

    def __init__(self, max_depth: int = DEFAULT_MAX_DEPTH, max_tokens: int = DEFAULT_MAX_CACHED_TOKENS):
        check_index_settings(max_depth, max_tokens)
        self.max_depth = max_depth
        self.max_tokens = max_tokens
        self.root = _Node(None, None, 0, 0, None, 0)
        self.docs: set[_Doc] = set()  # every doc in the tree, running or cached
        self.cached: OrderedDict[_Doc, None] = OrderedDict()  # finished docs, least recently used first
        self.num_tokens = 0
        self.evicted_docs = 0
        self._serial = 0

    # --- docs -------------------------------------------------------------------------------------------
    def new_doc(self, tokens=()) -> _Doc:
        self._serial += 1
        doc = _Doc(self.max_depth, self._serial)
        self.docs.add(doc)
        if tokens:
            self.extend(doc, tokens)
        return doc

    def finish(self, doc: _Doc) -> None:
        """The doc's text is complete: it becomes cached text, the most recently used."""
        if doc.active is None:
            return
        doc.active = None
        self.cached[doc] = None
        self.evict()

    def touch(self, doc: _Doc) -> None:
        if doc in self.cached:
            self.cached.move_to_end(doc)

    def evict(self) -> None:
        """Remove finished docs, least recently used first, while the index holds more than max_tokens."""
        while self.num_tokens > self.max_tokens and self.cached:
            doc, _ = self.cached.popitem(last=False)
            self.remove(doc)
            self.evicted_docs += 1

    # --- appending ----------------------------------------------------------------------------------------
    def extend(self, doc: _Doc, tokens) -> None:
        """Append tokens to a running doc: each extends the doc's active suffixes by one (module docstring)."""
        active = doc.active
        if active is None:
            raise ValueError("cannot extend a finished doc")
        root = self.root
        depth = self.max_depth
        toks = doc.tokens
        self.num_tokens += len(tokens)
        for t in tokens:
            active.append(root)  # the new one-token suffix; maxlen drops the suffix that reached max_depth
            root.count += 1
            toks.append(t)
            n = len(toks)
            size = len(active)
            base = n - size  # active[i] is the suffix toks[base + i:]
            first = 0
            while active[first].limit is not None:  # open leaves grow with the doc by themselves
                first += 1
            for i in range(first, size):
                node = active[i]
                children = node.children
                child = children.get(t) if children is not None else None
                if child is None:
                    if node.count == 1 and node is not root:
                        # A closed leaf holding this suffix alone (after an eviction): open it.
                        node.limit = base + i + depth
                        node.ends = None
                        continue
                    # A new open leaf for this suffix.
                    new = _Node(node, doc, n - 1, 0, base + i + depth, 1)
                    if children is None:
                        node.children = {t: new}
                        node.best = new
                    else:
                        children[t] = new
                        best = node.best
                        if best is not None and best.count <= 1:
                            node.best = new
                    node.cont += 1
                    ends = node.ends
                    if ends is not None:
                        ends.pop(doc, None)
                        if not ends:
                            node.ends = None
                    active[i] = new
                    continue
                if child.limit is None:
                    clen = child.length
                else:
                    clen = min(len(child.doc.tokens), child.limit) - child.start
                if node is not root and node.count == child.count + 1:
                    # Only this suffix ends at node, and every other one continues into child.
                    nlen = node.length
                    if clen == 1:
                        # This suffix reaches child's end: child absorbs node's edge and takes its place.
                        parent = node.parent
                        key = node.doc.tokens[node.start]
                        _close(child)
                        child.ends[doc] = n
                        child.count += 1
                        child.length = nlen + 1
                        child.doc = doc
                        child.start = n - nlen - 1
                        child.parent = parent
                        parent.children[key] = child
                        if parent.best is node:
                            parent.best = child
                        active[i] = child
                    else:
                        # Move the boundary between node and child one token down.
                        node.length = nlen + 1
                        node.ends[doc] = n
                        node.doc = doc
                        node.start = n - nlen - 1
                        child.start += 1
                        if child.limit is None:
                            child.length = clen - 1
                        key = child.doc.tokens[child.start]
                        if key != t:
                            del children[t]
                            children[key] = child
                    continue
                ends = node.ends
                if ends is not None:
                    ends.pop(doc, None)
                    if not ends:
                        node.ends = None
                node.cont += 1
                if clen == 1:
                    # Step into child.
                    _close(child)
                    child.ends[doc] = n
                    child.count += 1
                    child.doc = doc
                    child.start = n - 1
                    best = node.best
                    if best is not None and best is not child and child.count >= best.count:
                        node.best = child
                    active[i] = child
                else:
                    # Split child after its first token; this suffix ends at the new node.
                    new = _Node(node, doc, n - 1, 1, None, child.count + 1)
                    new.ends = {doc: n}
                    new.cont = child.count
                    new.best = child
                    child.start += 1
                    if child.limit is None:
                        child.length = clen - 1
                    new.children = {child.doc.tokens[child.start]: child}
                    child.parent = new
                    children[t] = new
                    best = node.best
                    if best is child or (best is not None and new.count >= best.count):
                        node.best = new
                    active[i] = new
        if self.num_tokens > self.max_tokens:
            self.evict()

    # --- removing -----------------------------------------------------------------------------------------
    def remove(self, doc: _Doc) -> None:
        """Take a doc's suffixes out of the tree."""
        toks = doc.tokens
        n = len(toks)
        depth_cap = self.max_depth
        root = self.root
        for j in range(n):
            length = min(depth_cap, n - j)
            node = root
            root.count -= 1
            depth = 0
            path: list[_Node] = []
            while depth < length:
                key = toks[j + depth]
                child = node.children[key]
                child.count -= 1
                node.cont -= 1
                if node.best is child:
                    node.best = None
                if child.count == 0:
                    del node.children[key]
                    if not node.children:
                        node.children = None
                    break
                ends = child.ends
                if ends is not None and doc in ends:
                    del ends[doc]
                    if not ends:
                        child.ends = None
                depth += child.edge_length()
                path.append(child)
                node = child
            # The last node may now have one child and nothing ending at it: merge them.
            if node is not root and node.children is not None and len(node.children) == 1:
                (only,) = node.children.values()
                if only.count == node.count:
                    parent = node.parent
                    parent.children[node.doc.tokens[node.start]] = only
                    if parent.best is node:
                        parent.best = only
                    only.start -= node.length
                    if only.limit is None:
                        only.length += node.length
                    only.parent = parent
                    path[-1] = node = only
            if any(p.doc is doc for p in path):
                self._repoint(path, node, doc)
        self.docs.discard(doc)
        self.cached.pop(doc, None)
        self.num_tokens -= n
        doc.active = None

    @staticmethod
    def _repoint(path: list[_Node], node: _Node, doc: _Doc) -> None:
        """Re-point the nodes of `path` (root's child .. node) that refer to `doc` at another occurrence: one
        that ends at a leaf below node. Left for later when that leaf's only known end is in doc itself (a
        later suffix of doc that passes here does it)."""
        leaf, below = node, 0
        while leaf.children is not None:
            leaf = next(iter(leaf.children.values()))
            below += leaf.edge_length()
        if leaf.limit is not None:
            if leaf.doc is doc:
                return
            other, end = leaf.doc, min(len(leaf.doc.tokens), leaf.limit)
        else:
            other = next((d for d in (leaf.ends or ()) if d is not doc), None)
            if other is None:
                return
            end = leaf.ends[other]
        position = end - below
        for p in reversed(path):
            position -= p.edge_length()
            if p.doc is doc:
                p.doc, p.start = other, position

    # --- drafting -------------------------------------------------------------------------------------------
    def match_length(self, doc: _Doc) -> int:
        """The longest m such that the doc's last m tokens occur (anywhere in the index) followed by a token."""
        active = doc.active
        size = len(active)
        m = 0
        while m < size and active[size - 1 - m].children is not None:
            m += 1
        return m

    def speculate(self, doc: _Doc, max_tokens: int, factor: float = DEFAULT_MAX_SPEC_FACTOR,
                  min_prob: float = DEFAULT_MIN_TOKEN_PROB, prior: float = DEFAULT_UNSEEN_PRIOR) -> list[int]:
        """The draft for a running doc: from its longest match, the most frequent continuation, at most
        min(max_tokens, factor x match length) tokens, while the product of the (smoothed, see _follow)
        empirical probabilities stays >= min_prob."""
        m = self.match_length(doc)
        cap = min(max_tokens, int(m * factor + 1e-9))
        if m == 0 or cap <= 0:
            return []
        node = doc.active[len(doc.active) - m]
        return self._follow(node, node.edge_length(), m, cap, min_prob, doc.tokens, prior)

    def speculate_pattern(self, pattern: list[int], max_tokens: int, factor: float = DEFAULT_MAX_SPEC_FACTOR,
                          min_prob: float = DEFAULT_MIN_TOKEN_PROB, prior: float = DEFAULT_UNSEEN_PRIOR) -> list[int]:
        """The same for any token list (not a doc): the longest suffix of it found with a continuation, by
        walking from the root (O(max_depth^2); `speculate` needs no search)."""
        best = None
        for m in range(1, min(len(pattern), self.max_depth - 1) + 1):
            found = self._walk(pattern[len(pattern) - m:])
            if found is None:
                break
            node, offset, _ = found
            if offset == node.edge_length() and node.children is None:
                break
            best = (m, found)
        if best is None:
            return []
        m, (node, offset, depth) = best
        cap = min(max_tokens, int(m * factor + 1e-9))
        return self._follow(node, offset, depth, cap, min_prob, list(pattern), prior) if cap > 0 else []

    def speculate_tree(self, doc: _Doc, max_nodes: int, max_depth: int, factor: float = DEFAULT_MAX_SPEC_FACTOR,
                       min_prob: float = DEFAULT_MIN_TOKEN_PROB,
                       prior: float = DEFAULT_UNSEEN_PRIOR) -> tuple[list[int], list[int], list[float]]:
        """A token tree for a running doc: from its longest match, the continuations of every occurrence, most
        probable first (the product of the smoothed empirical probabilities along the path, as `speculate`
        computes them), at most max_nodes nodes and min(max_depth, factor x match length) levels, each node's
        probability >= min_prob. Returns (tokens, parents, probabilities) in node order (parents[i] < i, -1: a
        child of the doc's end), siblings most probable first; its first path is `speculate`'s draft where the
        budget allows. ([], [], []): no confident match."""
        m = self.match_length(doc)
        cap = min(max_depth, int(m * factor + 1e-9))
        if m == 0 or cap <= 0 or max_nodes <= 0:
            return [], [], []
        node = doc.active[len(doc.active) - m]
        history = doc.tokens
        tokens: list[int] = []
        parents: list[int] = []
        probs: list[float] = []
        paths: list[list[int]] = []
        heap: list = []
        serial = itertools.count()
        used: set[_Doc] = set()

        def offer(position, parent: int, prob: float, path: list[int]) -> None:
            """Push the tokens that may follow `path` at `position` (node, offset into its edge, depth)."""
            node, offset, depth = position
            while True:
                if offset < node.edge_length():  # inside an edge: one continuation, the same probability
                    token = node.doc.tokens[node.start + offset]
                    heapq.heappush(heap, (-prob, next(serial), parent, token, (node, offset + 1, depth + 1), node.doc))
                    return
                if node.children is not None:
                    break
                if depth < self.max_depth:
                    return  # every occurrence ends here
                found = self._reanchor(path, history)
                if found is None:
                    return
                node, offset, depth = found
            total = _smoothed_total(node, depth, prior)
            best = node.best if node.best is not None else max(node.children.values(), key=_count)
            floor = min_prob * total / prob  # a child's count below this falls under min_prob
            # The most frequent child first, so that ties keep `speculate`'s choice.
            for child in [best] + [c for c in node.children.values() if c is not best]:
                if child.count >= floor:
                    heapq.heappush(heap, (-(prob * child.count / total), next(serial), parent,
                                          child.doc.tokens[child.start], (child, 1, depth + 1), child.doc))

        offer((node, node.edge_length(), m), -1, 1.0, [])
        while heap and len(tokens) < max_nodes:
            neg_prob, _, parent, token, position, source = heapq.heappop(heap)
            path = (paths[parent] if parent >= 0 else []) + [token]
            tokens.append(token)
            parents.append(parent)
            probs.append(-neg_prob)
            paths.append(path)
            used.add(source)
            if len(path) < cap:
                offer(position, len(tokens) - 1, -neg_prob, path)
        for source in used:
            self.touch(source)
        return tokens, parents, probs

    def _walk(self, pattern: list[int]):
        """(node, tokens of its edge matched, depth) where `pattern` ends when read from the root; None when
        the index does not hold it."""
        node, offset, depth = self.root, 0, 0
        i, size = 0, len(pattern)
        while i < size:
            children = node.children
            child = children.get(pattern[i]) if children is not None else None
            if child is None:
                return None
            clen = child.edge_length()
            take = min(clen, size - i)
            start = child.start
            if child.doc.tokens[start:start + take] != pattern[i:i + take]:
                return None
            i += take
            depth += take
            node, offset = child, take
        return node, offset, depth

    def _reanchor(self, drafted: list[int], history: list[int]):
        """Past the tree's depth it holds no longer contexts: where the last max_depth // 2 tokens of history +
        drafted end (_walk's answer; None when the index does not hold them)."""
        anchor = max(1, self.max_depth // 2)
        tail = drafted[-anchor:]
        if len(tail) < anchor:
            tail = history[len(history) - (anchor - len(tail)):] + tail
        return self._walk(tail)

    def _follow(self, node: _Node, offset: int, depth: int, cap: int, min_prob: float,
                history: list[int], prior: float) -> list[int]:
        """Up to `cap` tokens from (node, offset into its edge, depth): the rest of the edge, then the most
        frequent child while the running probability stays >= min_prob, each child's probability being
        count / (the siblings' counts + prior / 2^(depth - 1))."""
        out: list[int] = []
        prob = 1.0
        limit = self.max_depth
        used = None
        while len(out) < cap:
            nlen = node.edge_length()
            if offset < nlen:  # inside an edge: every occurrence continues the same way
                take = min(nlen - offset, cap - len(out))
                start = node.start + offset
                out.extend(node.doc.tokens[start:start + take])
                offset += take
                depth += take
                used = node.doc
                continue
            children = node.children
            if children is None:
                if depth < limit:
                    break  # every occurrence ends here (the end of a text)
                found = self._reanchor(out, history)
                if found is None:
                    break
                node, offset, depth = found
                continue
            best = node.best
            if best is None:
                best = node.best = max(children.values(), key=_count)
            prob *= best.count / _smoothed_total(node, depth, prior)
            if prob < min_prob:
                break
            node, offset = best, 0
        if used is not None:
            self.touch(used)
        return out

    # --- checks (tests) ---------------------------------------------------------------------------------------
    def check(self) -> None:
        """Assert the tree's invariants against a count from scratch (slow: for tests)."""
        visits: dict[int, int] = {}
        depth_cap = self.max_depth
        for doc in self.docs:
            toks = doc.tokens
            for j in range(len(toks)):
                length = min(depth_cap, len(toks) - j)
                node, depth = self.root, 0
                visits[id(node)] = visits.get(id(node), 0) + 1
                while depth < length:
                    node = node.children[toks[j + depth]]
                    nlen = node.edge_length()
                    assert depth + nlen <= length, "a path runs past its suffix"
                    assert toks[j + depth: j + depth + nlen] == node.doc.tokens[node.start:node.start + nlen]
                    visits[id(node)] = visits.get(id(node), 0) + 1
                    depth += nlen
                if node.limit is not None:
                    assert node.doc is doc, "an open leaf holds another doc's suffix"
                else:
                    assert node.ends is not None and doc in node.ends, "a suffix's end is not recorded"
            if doc.active is not None:
                size = len(doc.active)
                for i, node in enumerate(doc.active):
                    found = self._walk(toks[len(toks) - size + i:])
                    assert found is not None and found[0] is node and found[1] == node.edge_length(), \
                        "an active suffix is not where the doc says"
        assert self.num_tokens == sum(len(d.tokens) for d in self.docs)
        assert set(self.cached) <= self.docs
        stack = [self.root]
        while stack:
            node = stack.pop()
            assert visits.get(id(node), 0) == node.count, "a count differs from the suffixes through the node"
            children = node.children
            assert children is None or children, "an empty children dict"
            assert node.cont == sum(c.count for c in (children or {}).values())
            if node is not self.root:
                assert node.doc in self.docs, "a node refers to a removed doc"
                assert node.edge_length() >= 1
                assert node.count >= 1
                if node.limit is not None:
                    assert node.count == 1 and children is None and not node.ends
                if children is not None and len(children) == 1:
                    assert node.cont < node.count, "a node with one child and nothing ending at it"
                for d, end in (node.ends or {}).items():
                    assert d in self.docs and 0 < end <= len(d.tokens)
            if node.best is not None:
                assert node.best in children.values() and node.best.count == max(c.count for c in children.values())
            for key, child in (children or {}).items():
                assert child.parent is node and child.doc.tokens[child.start] == key
                stack.append(child)


def _smoothed_total(node: _Node, depth: int, prior: float) -> float:
    """The denominator of a child's probability at `node` (reached at `depth`): the continuations seen there plus
    a pseudo-count of unseen ones, prior at a context of one token, halving with each further token."""
    return node.cont + prior / (1 << min(max(depth - 1, 0), 30))


def _count(node: _Node) -> int:
    return node.count


def _close(node: _Node) -> None:
    """Make a node's length explicit and its ends a dict, before a second suffix comes to end at it."""
    if node.limit is not None:
        doc = node.doc
        end = min(len(doc.tokens), node.limit)
        node.length = end - node.start
        node.limit = None
        node.ends = {doc: end}
    elif node.ends is None:
        node.ends = {}
