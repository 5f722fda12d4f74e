"""Bad input gets an error a person can act on, raised in Python before anything reaches XLA."""

import jax
import numpy as np
import pytest

import jaxattn

f32 = lambda *shape: np.zeros(shape, np.float32)
q, k, v = f32(4, 8), f32(5, 8), f32(5, 3)
Q, K, V = f32(4, 6, 8), f32(5, 3, 8), f32(5, 3, 8)
params = jaxattn.init_attention_params(0, 12, 4)

CASES = [
    # (id, call, exception, message regex)
    ("qk head dim", lambda: jaxattn.attention(q, f32(5, 7), f32(5, 3)), ValueError,
     r"q and k must have the same head dimension H: q has shape \(4, 8\) \[T, H\], k has shape \(5, 7\) \[S, H\]"),
    ("kv length", lambda: jaxattn.attention(q, k, f32(6, 3)), ValueError,
     r"k and v must have the same length S: k has shape \(5, 8\) \[S, H\], v has shape \(6, 3\) \[S, V\]"),
    ("mask shape", lambda: jaxattn.attention(q, k, v, mask=np.ones((4, 4), bool)), ValueError,
     r"mask must be broadcastable to \[T, S\] = \(4, 5\), received shape \(4, 4\)"),
    ("mask rank", lambda: jaxattn.attention(q, k, v, mask=np.ones((2, 4, 5), bool)), ValueError,
     r"mask must be broadcastable to \[T, S\] = \(4, 5\), received shape \(2, 4, 5\)"),
    ("bias shape", lambda: jaxattn.attention(q, k, v, bias=f32(3, 5)), ValueError,
     r"bias must be broadcastable to \[T, S\] = \(4, 5\), received shape \(3, 5\)"),
    ("mask dtype", lambda: jaxattn.attention(q, k, v, mask=np.ones((4, 5), np.int32)), TypeError,
     r"mask must be a boolean keep-mask \(True = attend\), received dtype int32"),
    ("int q", lambda: jaxattn.attention(np.zeros((4, 8), np.int32), k, v), TypeError,
     r"q must have a floating dtype .* received dtype int32"),
    ("bool k", lambda: jaxattn.attention(q, np.zeros((5, 8), bool), v), TypeError,
     r"k must have a floating dtype .* received dtype bool"),
    ("int v", lambda: jaxattn.attention(q, k, np.zeros((5, 3), np.int64)), TypeError,
     r"v must have a floating dtype .* received dtype int64"),
    ("scale nan", lambda: jaxattn.attention(q, k, v, scale=float("nan")), ValueError,
     r"scale must be finite and > 0 in float32, the dtype the logits are computed in \(None means 1/sqrt\(H\)\), received nan"),
    ("scale inf", lambda: jaxattn.attention(q, k, v, scale=float("inf")), ValueError, r"scale must be finite and > 0.*inf"),
    ("scale zero", lambda: jaxattn.attention(q, k, v, scale=0.0), ValueError, r"scale must be finite and > 0.*received 0.0"),
    ("scale negative", lambda: jaxattn.attention(q, k, v, scale=-1.0), ValueError, r"scale must be finite and > 0.*-1.0"),
    ("scale string", lambda: jaxattn.attention(q, k, v, scale="1"), TypeError, r"scale must be a real, positive, finite scalar or None"),
    ("q rank", lambda: jaxattn.attention(f32(8), k, v), ValueError,
     r"q must have 2 dimensions \[T, H\], received shape \(8,\) \(1 dimensions\)"),
    ("k rank", lambda: jaxattn.attention(q, f32(1, 5, 8), v), ValueError, r"k must have 2 dimensions \[S, H\], received shape \(1, 5, 8\)"),
    ("v rank", lambda: jaxattn.attention(q, k, f32(5)), ValueError, r"v must have 2 dimensions \[S, V\], received shape \(5,\)"),
    ("weights rank", lambda: jaxattn.attention_weights(f32(2, 4, 8), k), ValueError, r"q must have 2 dimensions \[T, H\]"),
    ("mha q rank", lambda: jaxattn.multi_head_attention(q, K, V), ValueError,
     r"q must have 3 dimensions \[T, N, H\], received shape \(4, 8\)"),
    ("mha head dim", lambda: jaxattn.multi_head_attention(Q, f32(5, 3, 4), f32(5, 3, 4)), ValueError,
     r"q and k must have the same head dimension H: q has shape \(4, 6, 8\) \[T, N, H\], k has shape \(5, 3, 4\)"),
    ("mha v", lambda: jaxattn.multi_head_attention(Q, K, f32(6, 3, 8)), ValueError,
     r"v must have shape \[S, K, V\] = \[5, 3, V\] to match k \(5, 3, 8\), received \(6, 3, 8\)"),
    ("gqa heads", lambda: jaxattn.multi_head_attention(Q, f32(5, 4, 8), f32(5, 4, 8)), ValueError,
     r"the number of query heads N must be a multiple of the number of key/value heads K .* N=6 .* K=4"),
    ("mha mask", lambda: jaxattn.multi_head_attention(Q, K, V, mask=np.ones((5, 4, 5), bool)), ValueError,
     r"mask must be broadcastable to \[N, T, S\] = \(6, 4, 5\), received shape \(5, 4, 5\)"),
    ("N divides D", lambda: jaxattn.init_attention_params(0, 10, 4), ValueError,
     r"num_heads N=4 must divide d_model D=10 \(H = D / N\), or pass head_dim"),
    ("init gqa", lambda: jaxattn.init_attention_params(0, 12, 4, num_kv_heads=3), ValueError,
     r"num_heads \(4\) must be a multiple of num_kv_heads \(3\)"),
    ("layer heads", lambda: jaxattn.attention_layer(params, f32(3, 12), num_heads=5), ValueError,
     r"params\['W_Q'\] has 12 output columns, which 5 heads do not divide"),
    ("layer width", lambda: jaxattn.attention_layer(params, f32(3, 10), num_heads=4), ValueError,
     r"params\['W_Q'\] must have shape \[10, heads\*H\] to project an input of shape \(3, 10\), received \(12, 12\)"),
    ("layer bias", lambda: jaxattn.attention_layer({**params, "b_Q": f32(7)}, f32(3, 12), num_heads=4), ValueError,
     r"params\['b_Q'\] must have shape \[12\] \(the columns of params\['W_Q'\]\), received \(7,\)"),
    ("layer out bias", lambda: jaxattn.attention_layer({**params, "b_O": f32(12, 1)}, f32(3, 12), num_heads=4), ValueError,
     r"params\['b_O'\] must have shape \[12\] \(the columns of params\['W_O'\]\), received \(12, 1\)"),
    ("lse bias", lambda: jaxattn.weights_from_lse(q, k, f32(4), bias=f32(3, 5)), ValueError,
     r"bias must be broadcastable to \[T, S\] = \(4, 5\), received shape \(3, 5\)"),
    ("layer params", lambda: jaxattn.attention_layer({"W_Q": params["W_Q"]}, f32(3, 12), num_heads=4), ValueError,
     r"params is missing \['W_K', 'W_V', 'W_O'\]"),
    ("layer int h", lambda: jaxattn.attention_layer(params, np.zeros((3, 12), np.int32), num_heads=4), TypeError,
     r"h must have a floating dtype"),
    ("split heads", lambda: jaxattn.split_heads(f32(3, 10), 4), ValueError, r"must be divisible by num_heads=4"),
]


@pytest.mark.parametrize("call, exc, message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_raises_a_clear_error(call, exc, message):
    with pytest.raises(exc, match=message):
        call()


def test_errors_are_raised_while_tracing_before_compilation():
    traced = jax.jit(lambda a, b, c: jaxattn.attention(a, b, c))
    with pytest.raises(ValueError, match=r"k and v must have the same length S"):
        traced.lower(q, k, f32(6, 3))  # lowering traces in Python; nothing reaches XLA
